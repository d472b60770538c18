"""Images to latents and back to training batches: the encode pipeline, the latent store, the loader."""
