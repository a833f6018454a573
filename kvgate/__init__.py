"""kvgate: an inference gateway for Kubernetes (engine, endpoint picker, operator)."""

__version__ = "0.1.0"
