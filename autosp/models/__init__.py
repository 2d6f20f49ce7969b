"""Models of our own: a small reference transformer used by tests, benches and examples."""

from autosp.models.reference import ReferenceConfig, ReferenceTransformer, reference_factory

__all__ = ["ReferenceConfig", "ReferenceTransformer", "reference_factory"]
