"""angel-jax: SPMD training of large transformers on JAX."""
