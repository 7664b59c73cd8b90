"""Tests of the Felix Python client (unittest)."""
