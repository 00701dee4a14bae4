"""The flex attention family."""
