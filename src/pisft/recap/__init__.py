"""The RECAP loop around the SFT run: collect rollouts, train a value model, label advantages,
summarise the iterations (README, "The RECAP loop")."""
