"""rlfleet: PPO post-training for language models as gRPC microservices.

Importing the package is cheap and torch-free; each service imports its heavy
dependencies where it needs them.
"""

__version__ = "0.1.0"
