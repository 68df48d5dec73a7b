"""Lightning integration: the strategy, the island mechanics and the monitor callback."""
