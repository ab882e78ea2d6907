"""treadle: write the RL loop locally, run the heavy steps on shared workers."""
