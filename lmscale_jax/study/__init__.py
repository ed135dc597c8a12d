"""The scaling study: sweeps, the cluster and storage models, reports, batch-size search."""
