//! Gate policies drawn from the documented grammar (docs/ci.md §2): a
//! `moeconf.toml` text with `default_profile`, `[profile.default]` and a
//! named profile, each with a drawn subset of `levels`, `equal_nan`, the
//! near-tie margins, `dtype_tolerance`, `rules` (every check with its keys)
//! and `required`; sometimes a value the loader must refuse (a negative or
//! non-finite threshold, an unknown key, a rule after the catch-all), and
//! command-line overrides on top.

use arbitrary::{Result, Unstructured};
use moeconf_fingerprint::Level;
use moeconf_gate::policy::{Mode, Overrides, Requirement};
use std::fmt::Write as _;
use std::path::Path;

const MODES: [&str; 3] = ["bitwise", "tolerance", "info"];
const GLOBS: [&str; 9] = [
    "*",
    "lm.*",
    "layer.*",
    "moe.term.?",
    "router.*",
    "state.*",
    "token.*",
    "*.margin",
    "?*",
];
const THRESHOLDS: [&str; 10] = [
    "0.0", "1e-6", "0.01", "0.05", "0.5", "1.0", "10.0", "1e30", "-1.0", "nan",
];

fn threshold(u: &mut Unstructured<'_>) -> Result<&'static str> {
    // Mostly valid; a negative or NaN threshold one time in ten.
    Ok(if u.ratio(1, 10)? {
        u.choose(&THRESHOLDS[8..])?
    } else {
        u.choose(&THRESHOLDS[..8])?
    })
}

/// One rule `{ path, level?, check, ... }` (without the closing brace).
fn rule(u: &mut Unstructured<'_>, catch_all: bool) -> Result<String> {
    let mut s = String::from("{ path = \"");
    s.push_str(if catch_all { "*" } else { u.choose(&GLOBS)? });
    s.push('"');
    if !catch_all && u.arbitrary()? {
        let _ = write!(s, ", level = \"L{}\"", u.int_in_range(0..=4u8)?);
    }
    let keys: &[&str] = match u.int_in_range(0..=5u8)? {
        0 => {
            s.push_str(", check = \"exact\"");
            &[]
        }
        1 => {
            s.push_str(", check = \"elementwise\"");
            &["rtol", "atol"]
        }
        2 => {
            let _ = write!(
                s,
                ", check = \"ulp\", max_ulp = {}",
                u.int_in_range(0..=1u32 << 23)?
            );
            &[]
        }
        3 => {
            s.push_str(", check = \"aggregate\"");
            &["cosine_min", "norm_ratio_tol", "nmse_max"]
        }
        4 => {
            if u.arbitrary()? {
                let _ = write!(s, ", topk = {}", u.int_in_range(0..=10u32)?);
            }
            s.push_str(", check = \"logits\"");
            &["topk_overlap_min", "kl_max"]
        }
        _ => {
            s.push_str(", check = \"ignore\"");
            &[]
        }
    };
    for k in keys {
        if u.arbitrary()? {
            let _ = write!(s, ", {k} = {}", threshold(u)?);
        }
    }
    s.push_str(" }");
    Ok(s)
}

/// The body of one `[profile.NAME]` table.
fn profile(u: &mut Unstructured<'_>) -> Result<String> {
    let mut s = String::new();
    if u.arbitrary()? {
        let mut entries = Vec::new();
        for l in 0..5 {
            if u.arbitrary()? {
                entries.push(format!("L{l} = \"{}\"", u.choose(&MODES)?));
            }
        }
        let _ = writeln!(s, "levels = {{ {} }}", entries.join(", "));
    }
    if u.arbitrary()? {
        let _ = writeln!(s, "equal_nan = {}", u.arbitrary::<bool>()?);
    }
    for key in ["route_near_tie_margin", "argmax_near_tie_margin"] {
        if u.arbitrary()? {
            let _ = writeln!(s, "{key} = {}", threshold(u)?);
        }
    }
    if u.ratio(1, 3)? {
        let d = u.choose(&["f32", "bf16", "f64", "i32"])?;
        let _ = writeln!(
            s,
            "dtype_tolerance = {{ {d} = {{ rtol = {}, atol = {} }} }}",
            threshold(u)?,
            threshold(u)?
        );
    }
    if u.arbitrary()? {
        let mut rules = Vec::new();
        for _ in 0..u.int_in_range(0..=3)? {
            rules.push(rule(u, false)?);
        }
        // Almost always the catch-all last, as the grammar requires.
        if !u.ratio(1, 16)? {
            rules.push(rule(u, true)?);
        }
        let _ = writeln!(s, "rules = [ {} ]", rules.join(", "));
    }
    if u.arbitrary()? {
        let names = ["L0", "L1", "L2", "L3", "L4", "judged", "reference"];
        let mut req = Vec::new();
        for n in names {
            if u.ratio(1, 4)? {
                req.push(format!("\"{n}\""));
            }
        }
        let _ = writeln!(s, "required = [{}]", req.join(", "));
    }
    if u.ratio(1, 32)? {
        s.push_str("equal_nans = true\n");
    }
    Ok(s)
}

/// A drawn policy: the overrides `moeconf gate` would build from
/// `--policy`, `--profile`, `--level`, `--required` and the margins. When
/// a file is drawn it is written to `dir/moeconf.toml`.
pub fn overrides(u: &mut Unstructured<'_>, dir: &Path) -> Result<Overrides> {
    let mut o = Overrides::default();
    match u.int_in_range(0..=3u8)? {
        0 => o.profile = Some("default".into()),
        1 => o.profile = Some("strict".into()),
        _ => {
            let mut text = String::new();
            let named = u.arbitrary::<bool>()?;
            if named && u.arbitrary()? {
                text.push_str("default_profile = \"p\"\n");
            } else if named {
                o.profile = Some("p".into());
            }
            if u.arbitrary()? {
                let _ = write!(text, "[profile.default]\n{}", profile(u)?);
            }
            if named {
                let _ = write!(text, "[profile.p]\n{}", profile(u)?);
            }
            let path = dir.join("moeconf.toml");
            if std::fs::write(&path, text).is_err() {
                return Err(arbitrary::Error::IncorrectFormat);
            }
            o.policy = Some(path);
        }
    }
    for _ in 0..u.int_in_range(0..=2)? {
        let level = Level::ALL[u.choose_index(5)?];
        let mode = *u.choose(&[Mode::Bitwise, Mode::Tolerance, Mode::Info])?;
        o.levels.push((level, mode));
    }
    if u.ratio(1, 4)? {
        let mut req = Vec::new();
        for (i, r) in [
            Requirement::Judged,
            Requirement::Reference,
            Requirement::Level(Level::L0),
            Requirement::Level(Level::L1),
            Requirement::Level(Level::L2),
            Requirement::Level(Level::L3),
            Requirement::Level(Level::L4),
        ]
        .into_iter()
        .enumerate()
        {
            if u.ratio(1, 3 + i as u8 / 2)? {
                req.push(r);
            }
        }
        o.required = Some(req);
    }
    if u.ratio(1, 4)? {
        o.argmax_near_tie_margin = Some(*u.choose(&[0.0, 0.05, 1.0, 1e9])?);
    }
    if u.ratio(1, 4)? {
        o.route_near_tie_margin = Some(*u.choose(&[0.0, 0.05, 1.0, 1e9])?);
    }
    Ok(o)
}
