"""The varlen attention family."""
