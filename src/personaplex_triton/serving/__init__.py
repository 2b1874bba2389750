"""What Triton runs: the services behind model_repository's model.py files, the Triton adapter,
health, shutdown, the server launcher and config generation. It may import every lower layer."""
