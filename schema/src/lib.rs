//! moeconf trace container (in progress).
