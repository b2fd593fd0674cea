"""Shared pieces of every service: tensor codec, config, gRPC helpers, logging.

Nothing here imports torch at import time.
"""
