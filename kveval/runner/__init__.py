"""Running models under a policy: loading, greedy generation, teacher-forced fidelity, run specs and the eval runner."""
