//! Errors about the values of a run request (and of the sweeps and the
//! calibration suite built on runs), worded without any front
//! end's option names: a message holds [`Field`]s, which the `moeconf`
//! binary renders as its flags (`--fork-layer`) and every other caller as
//! their descriptions (`fork layer`).

use std::fmt;

/// One value of a run request that an error can be about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    /// The model: `builtin:NAME` or a checkpoint directory.
    Model,
    /// The capture spec ([`crate::CaptureSpec`]).
    Capture,
    /// The aggregation contract of every MoE combine.
    Contract,
    /// The schedule that varies the contract between combines.
    Schedule,
    /// The fork's decoder layer.
    ForkLayer,
    /// The contract at the fork.
    ForkContract,
    /// The summation order at the fork.
    ForkOrder,
    /// The forward step of the fork.
    ForkStep,
    /// The token position of the fork.
    ForkPosition,
    /// The number of tokens to generate.
    MaxNewTokens,
    /// The worker-thread count.
    Threads,
    /// The file the prompt is read from.
    PromptFile,
    /// Whether NaN and infinity may be recorded instead of ending the run.
    AllowNonFinite,
    /// A sweep's named scheme (a class family such as `a` or `b`).
    Scheme,
    /// A sweep's explicit branch contract.
    Branch,
    /// The calibration suite's protocol selection.
    Only,
}

impl Field {
    /// The field in words, as a library caller reads it.
    pub fn describe(self) -> &'static str {
        match self {
            Field::Model => "model",
            Field::Capture => "capture",
            Field::Contract => "contract",
            Field::Schedule => "schedule",
            Field::ForkLayer => "fork layer",
            Field::ForkContract => "fork contract",
            Field::ForkOrder => "fork order",
            Field::ForkStep => "fork step",
            Field::ForkPosition => "fork position",
            Field::MaxNewTokens => "max_new_tokens",
            Field::Threads => "threads",
            Field::PromptFile => "prompt file",
            Field::AllowNonFinite => "allow_non_finite",
            Field::Scheme => "scheme",
            Field::Branch => "branch",
            Field::Only => "protocol selection",
        }
    }
}

/// A message in which some words are [`Field`]s.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldMessage {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Field(Field),
}

impl FieldMessage {
    /// A message that starts with `field`.
    pub fn of(field: Field) -> FieldMessage {
        FieldMessage::default().field(field)
    }

    /// Appends `field`.
    pub fn field(mut self, field: Field) -> FieldMessage {
        self.parts.push(Part::Field(field));
        self
    }

    /// Appends literal text.
    pub fn text(mut self, text: impl Into<String>) -> FieldMessage {
        self.parts.push(Part::Text(text.into()));
        self
    }

    /// The fields the message names, in order.
    pub fn fields(&self) -> impl Iterator<Item = Field> + '_ {
        self.parts.iter().filter_map(|p| match p {
            Part::Field(f) => Some(*f),
            Part::Text(_) => None,
        })
    }

    /// The message with each field named by `name` (a front end passes its
    /// option names).
    pub fn render(&self, name: impl Fn(Field) -> String) -> String {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::Field(f) => out.push_str(&name(*f)),
            }
        }
        out
    }
}

/// What [`FieldMessage`]s are built from: a [`Field`] or text.
pub(crate) trait Piece {
    /// `m` with `self` appended.
    fn append(self, m: FieldMessage) -> FieldMessage;
}

impl Piece for Field {
    fn append(self, m: FieldMessage) -> FieldMessage {
        m.field(self)
    }
}

impl Piece for &str {
    fn append(self, m: FieldMessage) -> FieldMessage {
        m.text(self)
    }
}

impl Piece for String {
    fn append(self, m: FieldMessage) -> FieldMessage {
        m.text(self)
    }
}

impl fmt::Display for FieldMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(|x| x.describe().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_render_by_the_callers_names_or_by_their_descriptions() {
        let m = FieldMessage::of(Field::ForkStep)
            .text(" 5: ")
            .field(Field::MaxNewTokens)
            .text(" 3 runs forward steps 0 to 2");
        assert_eq!(
            m.to_string(),
            "fork step 5: max_new_tokens 3 runs forward steps 0 to 2"
        );
        let flag = |f: Field| format!("--{}", f.describe().replace(['_', ' '], "-"));
        assert_eq!(
            m.render(flag),
            "--fork-step 5: --max-new-tokens 3 runs forward steps 0 to 2"
        );
        assert_eq!(
            m.fields().collect::<Vec<_>>(),
            [Field::ForkStep, Field::MaxNewTokens]
        );
    }
}
