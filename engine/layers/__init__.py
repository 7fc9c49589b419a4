"""Building blocks shared by the models: norms and rotary embeddings."""
