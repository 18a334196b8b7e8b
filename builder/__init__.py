"""trainbox host side: matrix -> cells -> Dockerfiles -> locks -> images (see CONTRIBUTING.md)."""
