//! Placement of a create: among healthy nodes with room, those that hold
//! the template; among them the best of K picked at random by free room
//! (E2B's "best of K": near-balanced load without every gateway piling
//! onto the one emptiest node at once).

use super::super::cluster::catalog::Node;

/// How many nodes a placement looks at.
pub const BEST_OF: usize = 2;

/// Free room on a node: what it admits, less what runs (by its last
/// heartbeat or by the catalog, whichever is more) and what is placed
/// there and not yet published.
pub fn free(n: &Node) -> usize {
    n.status
        .capacity
        .saturating_sub(n.status.live.max(n.placed))
        .saturating_sub(n.reserved)
}

/// Whether `n` is healthy: heard from within `grace_ms`.
pub fn healthy(n: &Node, grace_ms: i64) -> bool {
    n.silent_ms <= grace_ms
}

/// The node for a sandbox of `template`, skipping `tried`; `pick(n)` is a
/// random index below `n`. `None`: no healthy node has room.
pub fn choose<'a>(
    nodes: &'a [Node],
    template: &str,
    grace_ms: i64,
    tried: &[String],
    mut pick: impl FnMut(usize) -> usize,
) -> Option<&'a Node> {
    let open: Vec<&Node> = nodes
        .iter()
        .filter(|n| healthy(n, grace_ms) && free(n) > 0 && !tried.contains(&n.id))
        .collect();
    let holding: Vec<&Node> = open
        .iter()
        .copied()
        .filter(|n| n.status.templates.iter().any(|t| t == template))
        .collect();
    let pool = if holding.is_empty() { open } else { holding };
    if pool.is_empty() {
        return None;
    }
    let mut best: Option<&Node> = None;
    for _ in 0..BEST_OF.min(pool.len()) {
        let n = pool[pick(pool.len())];
        if best.is_none_or(|b| free(n) > free(b)) {
            best = Some(n);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::catalog::NodeStatus;

    fn node(id: &str, capacity: usize, live: usize, silent_ms: i64, templates: &[&str]) -> Node {
        Node {
            id: id.into(),
            status: NodeStatus {
                address: format!("http://{id}"),
                capacity,
                live,
                templates: templates.iter().map(|t| t.to_string()).collect(),
                ..Default::default()
            },
            silent_ms,
            reserved: 0,
            placed: 0,
        }
    }

    #[test]
    fn healthy_nodes_with_room_and_the_template_first_then_the_freer_of_two() {
        let nodes = vec![
            node("a", 10, 9, 100, &["base"]),
            node("b", 10, 2, 100, &["base"]),
            node("c", 10, 0, 60_000, &["base"]), // silent: down
            node("d", 10, 10, 100, &["base", "tpl"]), // full
        ];
        // Both a and b seen: b has more room.
        let mut i = 0;
        let seq = |n: usize| {
            i += 1;
            (i - 1) % n
        };
        assert_eq!(choose(&nodes, "base", 15_000, &[], seq).unwrap().id, "b");
        // Tried b already: a.
        assert_eq!(
            choose(&nodes, "base", 15_000, &["b".into()], |_| 0)
                .unwrap()
                .id,
            "a"
        );
        // Only d holds tpl and it is full: any node with room.
        assert!(choose(&nodes, "tpl", 15_000, &[], |_| 0).is_some());
        let mut with_tpl = nodes.clone();
        with_tpl[0].status.templates.push("tpl".into());
        for _ in 0..10 {
            let mut r = 7usize;
            let pick = |n: usize| {
                r = r.wrapping_mul(31).wrapping_add(3);
                r % n
            };
            assert_eq!(choose(&with_tpl, "tpl", 15_000, &[], pick).unwrap().id, "a");
        }
        // Reservations, and sandboxes placed since the last heartbeat,
        // count as used room.
        let mut reserved = nodes.clone();
        reserved[0].reserved = 1;
        reserved[1].reserved = 4;
        reserved[1].placed = 6;
        assert!(choose(&reserved, "base", 15_000, &[], |_| 0).is_none());
    }
}
