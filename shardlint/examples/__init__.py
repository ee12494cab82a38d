"""Small model steps that the demo, the README and the tests use as CLI targets."""
