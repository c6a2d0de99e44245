//! BLAKE3's own tree, from the chaining values of aligned blocks: "hash a
//! stream cut into blocks, merge the blocks' values", for
//! [`crate::group_pages`] (a layer group's digest from its pages).
//! [`crate::incremental`] (a growing buffer's digest) merges the same tree
//! with the values of unchanged subtrees remembered between digests.
//!
//! A block is a power-of-two number of BLAKE3 chunks; BLAKE3's tree puts
//! every left subtree at the largest power of two of bytes strictly
//! smaller than its parent, so above one block every split falls on a
//! block boundary and a block's chaining value (`finalize_non_root` at its
//! offset) is a node of the tree (`blake3::hazmat`).

use blake3::hazmat::{left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, HasherExt, Mode};
use blake3::{Hasher, CHUNK_LEN};

/// Whether `block` bytes make a block of BLAKE3's tree: a power-of-two
/// multiple of [`CHUNK_LEN`].
pub fn is_block_size(block: u64) -> bool {
    block >= CHUNK_LEN as u64 && block.is_power_of_two()
}

/// The chaining value (non-root) of the block at byte `offset` of a stream
/// (a multiple of the block size) whose bytes are the concatenation of
/// `pieces`. Only for a stream longer than one block: the block is then
/// not the root.
pub fn block_cv(offset: u64, pieces: &[&[u8]]) -> [u8; 32] {
    let mut h = Hasher::new();
    h.set_input_offset(offset);
    for p in pieces {
        h.update(p);
    }
    h.finalize_non_root()
}

/// The BLAKE3 hash of a stream of `total` bytes, more than one block of
/// `block` bytes ([`is_block_size`]), from the chaining values of its
/// blocks in order (the last may be partial). `None` when the values are
/// not exactly `ceil(total / block)`, the stream fits in one block or the
/// block size is not one of BLAKE3's.
pub fn root_from_block_cvs(cvs: &[[u8; 32]], block: u64, total: u64) -> Option<blake3::Hash> {
    if !is_block_size(block) || total <= block || cvs.len() as u64 != total.div_ceil(block) {
        return None;
    }
    let left = left_subtree_len(total);
    Some(merge_subtrees_root(
        &subtree_cv(cvs, block, 0, left)?,
        &subtree_cv(cvs, block, left, total - left)?,
        Mode::Hash,
    ))
}

/// Chaining value of the subtree of `len` bytes at `offset` (a multiple of
/// the block size) from the blocks' values.
fn subtree_cv(cvs: &[[u8; 32]], block: u64, offset: u64, len: u64) -> Option<[u8; 32]> {
    if len <= block {
        return cvs.get(usize::try_from(offset / block).ok()?).copied();
    }
    let left = left_subtree_len(len);
    Some(merge_subtrees_non_root(
        &subtree_cv(cvs, block, offset, left)?,
        &subtree_cv(cvs, block, offset + left, len - left)?,
        Mode::Hash,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_merge_to_blake3_at_every_length_around_the_boundaries() {
        let data: Vec<u8> = (0..9 * 4 * CHUNK_LEN + 77)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for block in [CHUNK_LEN as u64, 4 * CHUNK_LEN as u64] {
            for total in [
                block + 1,
                2 * block,
                2 * block + 1,
                5 * block - 3,
                8 * block,
                9 * block + 5,
            ] {
                let total = total.min(data.len() as u64);
                let cvs: Vec<[u8; 32]> = (0..total.div_ceil(block))
                    .map(|j| {
                        let (a, b) = (j * block, ((j + 1) * block).min(total));
                        block_cv(a, &[&data[a as usize..b as usize]])
                    })
                    .collect();
                assert_eq!(
                    root_from_block_cvs(&cvs, block, total),
                    Some(blake3::hash(&data[..total as usize])),
                    "block {block} total {total}"
                );
                // One value too many or too few, or a stream of one block: no answer.
                assert_eq!(root_from_block_cvs(&cvs[1..], block, total), None);
                assert_eq!(root_from_block_cvs(&cvs, block, block), None);
            }
        }
        assert_eq!(root_from_block_cvs(&[[0; 32]; 2], 3000, 5000), None);
    }
}
