"""One phase of UNet training: the trainer, checkpoints (local and S3), resume, DDP, launch, validation."""
