//! Shared helpers for the workspace-level integration tests in `tests/`.
