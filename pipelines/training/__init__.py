"""The training pipeline's parts behind `pipelines/train.py`: config, the Ray Data stream (data,
features), the Ray Train loop (trainer), checkpoints, the closing evaluation and error reporting."""
