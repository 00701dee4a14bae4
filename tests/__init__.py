"""cpcompile test suite: folders by kind (unit, graphs, errors, parity, gpu) and the support package."""
