"""Exit codes an island process and its launcher agree on."""

EXIT_REFUSED = 78  # EX_CONFIG: an island the synchronizer refused for good; restarting it cannot help
