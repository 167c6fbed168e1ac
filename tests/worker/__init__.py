"""Tests of the worker layer."""
