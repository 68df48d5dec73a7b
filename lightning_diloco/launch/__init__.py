"""`lightning-diloco run`: a synchronizer and M islands on one host, supervised, with chaos schedules and a run report."""
