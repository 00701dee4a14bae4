"""Shared test machinery, imported as tests.support.<module>: fake process groups and graph capture, parity
references and tolerances, rounding counts. Helpers moved here from test files keep their names."""
