"""pisft: reproducible pi0.5 supervised fine-tuning on LIBERO RECAP data."""

__version__ = "0.1.0"
