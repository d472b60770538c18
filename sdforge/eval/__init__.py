"""Sampling from a checkpoint, eval grids and the demo probe, CLIP score / FID, diffusers export."""
