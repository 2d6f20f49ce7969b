"""Shipped hardware profiles (JSON data; see README.md)."""
