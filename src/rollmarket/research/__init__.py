"""Research tooling: campaigns, statistics, run comparison and adapter analysis."""
