"""Tests of the gspo command and the Python client."""
