//! Orders named by what determines them, resolved at one event.
//!
//! A named order is a [`Shape`] (how the operands are associated) over a
//! leaf [`Order`] (which permutation of the router slots feeds it). The leaf
//! orders determined by the event need its expert ids and gate weights, in
//! slot order: an [`EventContext`].
//!
//! Resolution rules (all sorts are stable, so ties keep slot order):
//!
//! * `identity` (router slot order): `[0, 1, …, k−1]`;
//! * `reversed`: `[k−1, …, 0]`;
//! * `asc-id` / `desc-id`: slots sorted by expert id, ascending / descending;
//!   slots with the same expert id (hash routing can repeat one) stay in slot
//!   order;
//! * `desc-gate` / `asc-gate`: slots sorted by gate weight in IEEE total
//!   order (`f32::total_cmp`: −0 < +0, NaN beyond ±∞ by sign), descending /
//!   ascending; bitwise-equal gates stay in slot order.

use super::error::ContractError;
use super::spec::{LaneFold, Order, Shape};

/// The router's choice at one event, in slot order: what the expert-id and
/// gate orders are determined by.
#[derive(Debug, Clone, Copy, Default)]
pub struct EventContext<'a> {
    /// Expert id of each slot.
    pub experts: &'a [u32],
    /// Gate weight of each slot.
    pub gates: &'a [f32],
}

impl EventContext<'_> {
    /// The permutation `order` gives for k slots (see the module docs).
    pub fn permutation(&self, order: &Order, k: usize) -> Result<Vec<usize>, ContractError> {
        let missing = |what: &'static str, got: usize| ContractError::ContextMismatch {
            order: order.to_string(),
            what,
            got,
            k,
        };
        let mut perm: Vec<usize> = (0..k).collect();
        match order {
            Order::AscendingId | Order::DescendingId => {
                if self.experts.len() != k {
                    return Err(missing("expert ids", self.experts.len()));
                }
                let ids = self.experts;
                if *order == Order::AscendingId {
                    perm.sort_by_key(|&j| ids[j]);
                } else {
                    perm.sort_by(|&a, &b| ids[b].cmp(&ids[a]));
                }
            }
            Order::DescendingGate | Order::AscendingGate => {
                if self.gates.len() != k {
                    return Err(missing("gate weights", self.gates.len()));
                }
                let g = self.gates;
                if *order == Order::AscendingGate {
                    perm.sort_by(|&a, &b| g[a].total_cmp(&g[b]));
                } else {
                    perm.sort_by(|&a, &b| g[b].total_cmp(&g[a]));
                }
            }
            other => return other.resolve_in(k, None),
        }
        Ok(perm)
    }

    /// Whether the event can resolve `order` for k slots (the expert-id
    /// orders need k ids, the gate orders k gates).
    pub fn resolves(&self, order: &Order, k: usize) -> bool {
        match order {
            Order::AscendingId | Order::DescendingId => self.experts.len() == k,
            Order::DescendingGate | Order::AscendingGate => self.gates.len() == k,
            _ => true,
        }
    }
}

/// The leaf orders named by what determines them, in the order reports prefer them.
pub const NAMED_ORDERS: [Order; 6] = [
    Order::Identity,
    Order::Reversed,
    Order::AscendingId,
    Order::DescendingId,
    Order::DescendingGate,
    Order::AscendingGate,
];

/// The shapes inference tries over every named leaf order, in the order
/// reports prefer them: sequential, the pairwise tree, and 2-, 4- and
/// 8-lane partial sums with the halving and the left-to-right fold.
pub const NAMED_SHAPES: [Shape; 6] = [
    Shape::Sequential,
    Shape::PairwiseTree,
    Shape::Lanes {
        width: 2,
        fold: LaneFold::Halving,
    },
    Shape::Lanes {
        width: 4,
        fold: LaneFold::Halving,
    },
    Shape::Lanes {
        width: 8,
        fold: LaneFold::Halving,
    },
    Shape::Lanes {
        width: 4,
        fold: LaneFold::Sequential,
    },
];

/// One named order resolved at an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedOrder {
    /// The leaf order (one of [`NAMED_ORDERS`]).
    pub order: Order,
    /// The permutation of the slots it gives at this event.
    pub permutation: Vec<usize>,
}

/// Named leaf orders that give the same permutation at one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderGroup {
    /// The coinciding named orders, in [`NAMED_ORDERS`] order.
    pub orders: Vec<Order>,
    /// The permutation they all give.
    pub permutation: Vec<usize>,
}

/// Every named leaf order the event can resolve for k slots, with the
/// concrete permutation each gives (in [`NAMED_ORDERS`] order; the
/// expert-id orders are left out when the context has no ids, the gate
/// orders when it has no gates).
pub fn orders_for(ctx: &EventContext<'_>, k: usize) -> Vec<ResolvedOrder> {
    NAMED_ORDERS
        .iter()
        .filter(|o| ctx.resolves(o, k))
        .filter_map(|o| {
            ctx.permutation(o, k).ok().map(|permutation| ResolvedOrder {
                order: o.clone(),
                permutation,
            })
        })
        .collect()
}

/// [`orders_for`] grouped by permutation: named orders that coincide on this
/// event (e.g. `identity` and `asc-id` when the router lists experts by
/// ascending id) form one group, in order of their first member.
pub fn order_groups(ctx: &EventContext<'_>, k: usize) -> Vec<OrderGroup> {
    let mut groups: Vec<OrderGroup> = Vec::new();
    for r in orders_for(ctx, k) {
        match groups.iter_mut().find(|g| g.permutation == r.permutation) {
            Some(g) => g.orders.push(r.order),
            None => groups.push(OrderGroup {
                orders: vec![r.order],
                permutation: r.permutation,
            }),
        }
    }
    groups
}
