//! The lie oracle on paged traces (docs/format.md §11.9, format version 4):
//! generated traces whose step-0 groups are stored as pages under a page
//! table (`moeconf_testkit::paged`), rewritten with the lies of
//! `moeconf_testkit::lies` (every class, and `LieClass::Pages`: falsified
//! page table entries, chaining values, page contents, page numbers and
//! order, records omitted, repeated or changed across page boundaries),
//! then compared through the commands with F's answers: the same answer or
//! an error, never another verdict, never a panic. The body is the `lies`
//! fuzz target's paged case (`targets::lies_paged_case`).

use moeconf_testkit::lies::{lie1, Lie, PageLie};
use moeconf_testkit::metamorphic::{answers_picked, profiles, Family, Outcome, Pick};
use moeconf_testkit::paged::{base, candidate};
use moeconf_testkit::seeds::{inputs, scratch_root};
use moeconf_testkit::targets::{lies_paged_case, PAGE_LIE, PAGE_LIE_ANSWERED, PASSED, REFUSED, VERDICT};

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(scratch_root()).unwrap()
}

/// Every page lie, about page `j` (the lies about a page and the next
/// about page `j - 1` when `j` is the last of a 2-page group).
fn page_lies(j: usize) -> Vec<PageLie> {
    let pair = j.saturating_sub(1);
    vec![
        PageLie::Cv(j),
        PageLie::Shift(pair),
        PageLie::Boundary(j),
        PageLie::Digest(j),
        PageLie::Missing,
        PageLie::Truncated(j),
        PageLie::Omit(j),
        PageLie::Extra(pair),
        PageLie::Repeat(j),
        PageLie::SwapWithin(j),
        PageLie::BoundaryEnd(pair),
        PageLie::BoundaryField(j),
        PageLie::Renumber(j),
        PageLie::SwapTable(pair),
        PageLie::SwapBlocks(pair),
        PageLie::FileOrder(pair),
        PageLie::Duplicate(pair),
    ]
}

/// The answers of F = base 0 and of F′ = F with the lie `l` to the
/// `cases` (family, case index; gate under the strict profile), G its
/// candidate `c`.
fn outcomes(
    l: &Lie,
    c: usize,
    cases: &[(Family, usize)],
    dir: &std::path::Path,
) -> (Vec<Outcome>, Vec<Outcome>) {
    let f = base(0, dir);
    let g = candidate(0, c, dir);
    let lied = lie1(&f, l).unwrap().expect("the lie applies");
    assert_ne!(&lied[..], &f[..], "{l:?} changed nothing");
    let p = profiles();
    let strict = [p[0].clone()];
    let run = |bytes: &[u8]| -> Vec<Outcome> {
        cases
            .iter()
            .map(|&(fam, k)| {
                answers_picked(fam, bytes, &g, dir, &strict, Pick::One(k))
                    .remove(0)
                    .1
            })
            .collect()
    };
    (run(&f), run(&lied))
}

/// The cases of [`outcomes`]: `diff F′ vs G` on use, `gate` (strict) F′ as
/// candidate on use, `diff F′ vs G --verify-all`.
const ON_USE: [(Family, usize); 2] = [(Family::Diff, 0), (Family::Gate, 1)];
const VERIFY_ALL: (Family, usize) = (Family::Diff, 3);

/// Every page lie, and every lie about its record count, about the first
/// paged group of base 0 (its L3 group, 2 pages) is refused by every command that reads the group's pages: by
/// diff and gate on use when the candidate differs in that group's page 1
/// (so the comparison reads both pages, which share a record), and by
/// `--verify-all` always. When the candidate differs from F only outside
/// the paged groups, diff and gate on use read no page of the group and
/// give F's answer: the lie is neither seen nor able to change the verdict.
#[test]
fn every_page_lie_is_refused_where_read_and_changes_nothing_unread() {
    let dir = scratch();
    let mut all = ON_USE.to_vec();
    all.push(VERIFY_ALL);
    let mut lies: Vec<Lie> = page_lies(1)
        .into_iter()
        .map(|lie| Lie::Page {
            step: 0,
            group: 0,
            lie,
        })
        .collect();
    // The group's record count a few records off (the layout moves), or
    // small enough that the group would not be paged; with and without
    // the level's and the trailer's counts following.
    for (delta, level) in [(1, true), (-1, false), (3, false), (-3, true), (-4000, true)] {
        lies.push(Lie::PagedRecords {
            step: 0,
            group: 0,
            delta,
            level,
        });
    }
    for l in &lies {
        // Candidate 1: one record of page 1 of the group differs.
        let (truth, lied) = outcomes(l, 1, &all, dir.path());
        for ((&(fam, k), t), x) in all.iter().zip(&truth).zip(&lied) {
            assert!(
                matches!(t, Outcome::Report(_)),
                "{fam:?} {k}: F itself is refused: {t:?}"
            );
            assert!(
                matches!(x, Outcome::Error(_)),
                "{l:?}: {fam:?} case {k} read the falsified pages and did not refuse them: {x:?}"
            );
        }
        // Candidate 6: only the last step's token differs. A page lie is
        // not read; a count lie is refused on open (the step block's
        // counts against the root block's) or, its level's count
        // following, where the step's write-order range moved.
        let (truth, lied) = outcomes(l, 6, &ON_USE, dir.path());
        for ((&(fam, k), t), x) in ON_USE.iter().zip(&truth).zip(&lied) {
            assert!(
                matches!(t, Outcome::Report(_)),
                "{fam:?} {k}: F itself is refused: {t:?}"
            );
            let counted = matches!(l, Lie::PagedRecords { .. });
            assert!(
                t == x || (counted && matches!(x, Outcome::Error(_))),
                "{l:?}: {fam:?} case {k} on use, no page read, another answer: {x:?}"
            );
        }
    }
}

/// The `lies` fuzz target's paged case on 300 deterministic seeds: lies of
/// every class (page lies first one time in two) about the paged bases,
/// one drawn command case each, the oracle asserted inside. The oracle
/// must have run on most seeds, page lies must have been both refused and
/// (unread) answered as F, and some lies answered as F.
#[test]
fn seeded_paged_lies_of_every_class() {
    let dir = scratch();
    let n = 300;
    let (mut ran, mut page, mut page_answered, mut passed, mut refused) = (0, 0, 0, 0, 0);
    for data in inputs(0x9a9e, n) {
        let s = lies_paged_case(&data, dir.path());
        ran += usize::from(s & VERDICT != 0);
        page += usize::from(s & PAGE_LIE != 0);
        page_answered += usize::from(s & PAGE_LIE_ANSWERED != 0);
        passed += usize::from(s & PASSED != 0);
        refused += usize::from(s & REFUSED != 0);
    }
    eprintln!(
        "{n} seeds: oracle ran on {ran}, {page} with a page lie ({page_answered} answered as F), \
         {passed} answered as F, {refused} refused"
    );
    assert!(ran >= n / 2, "the oracle ran on only {ran} of {n} seeds");
    assert!(page >= n / 5, "only {page} page lies");
    assert!(
        page_answered > 0 && page_answered < page,
        "{page_answered} of {page} page lies answered as F"
    );
    assert!(
        passed >= n / 10 && refused >= n / 10,
        "{passed} answered, {refused} refused"
    );
}
