"""What Triton sees: the services behind the model.py files, the Triton adapter, health,
shutdown, the server launcher and config generation. It may import every lower layer."""
