"""The test suite (mirrors the packages)."""
