"""The model runner: packs a step's tokens, runs the forward pass, samples."""
