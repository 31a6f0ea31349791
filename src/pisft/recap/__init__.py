"""The RECAP loop's value model and advantage labelling (issue 20, items 3-5).

- `value_model`: the distributional value model (pi0.5's own vision-language prefix, a learned
  read-out token, a bin head; two-hot targets, cross-entropy, V = expectation over the bins);
- `value_data`: the returns of the pool (`dataset/returns.parquet`), the value targets, the
  frames and their prompts as the value model reads them;
- `value_task`: the value model as a task of the training loop (`pisft.train.loop`);
- `value_metrics`: held-out Spearman rho, bin accuracy, the calibration plot;
- `value_training`: the `train_value` stage (torchrun/FSDP2, the training stage's machinery);
- `advantages`: the `advantages` stage (V for every frame, RLinf's N-step advantage, labels).

Sources: the pi*0.6 paper (arXiv 2511.14759, "RECAP"), RLinf
(`rlinf/models/embodiment/value_model/modeling_critic.py`,
`rlinf/data/datasets/recap/value_dataset.py`,
`examples/offline_rl/advantage_labeling/recap/process/compute_advantages.py`).
"""
