"""Reward service: rule scorers and reward models behind one gRPC contract.

Must import and run without torch (rule scoring only).
"""
