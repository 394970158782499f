"""What runs the apps for the CLI, the demos and the chaos runs: an embedded local cluster
(or an existing one) with `up` / `down`, the HTTP replay of trace requests, and the plots."""
