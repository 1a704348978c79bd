"""Adapters that plug kvfactory into other engines; each keeps that engine's interfaces in one module."""
