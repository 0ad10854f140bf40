"""Test-only stand-in for SGLang in the placement test (its trainer never asks a server anything)."""
