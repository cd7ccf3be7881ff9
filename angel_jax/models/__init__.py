"""Models: pure Flax modules built from `angel_jax.layers`."""
