"""The sdpa attention family."""
