"""A small typed Python client of the GSPO service API (httpx)."""

from gspo_client.client import ApiError, Client

__all__ = ["ApiError", "Client"]
