//! Why `moeconf invariance` reached no verdict.

/// An error of the matrix, the policy or the base run (exit 2). A single
/// configuration that cannot be judged is not an error of the run: it is an
/// `error` cell of the report (which also exits 2).
#[derive(Debug, thiserror::Error)]
pub enum InvarianceError {
    /// The matrix file or preset is invalid.
    #[error("matrix {source_name}: {message}")]
    Matrix { source_name: String, message: String },
    /// An expectation of the matrix or the policy is invalid.
    #[error("expectations in {source_name}: {message}")]
    Expectation { source_name: String, message: String },
    /// No preset of that name.
    #[error("no preset {name:?} (presets: {known})")]
    NoPreset { name: String, known: String },
    /// The matrix file cannot be read.
    #[error(transparent)]
    Input(#[from] moeconf_output::input::InputFileError),
    /// The base configuration could not be traced or opened: nothing can be compared.
    #[error("the base configuration: {message}")]
    Base { message: String },
}
