//! Random identifiers and secrets from the operating system's CSPRNG, and
//! the shape of a team's name.

/// `n` random bytes as lowercase hex.
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    getrandom::fill(&mut buf).expect("the OS random source works");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// A random index below `len` (> 0), for spreading choices (not secrets).
pub fn random_index(len: usize) -> usize {
    let mut buf = [0u8; 8];
    getrandom::fill(&mut buf).expect("the OS random source works");
    (u64::from_le_bytes(buf) % len.max(1) as u64) as usize
}

/// A sandbox id: lowercase letters and digits only, so it can be part of a
/// host name (`<port>-<id>.<domain>`).
pub fn sandbox_id() -> String {
    format!("i{}", random_hex(10))
}

/// A team name: 1-64 of `[A-Za-z0-9_-]`.
pub fn valid_team(team: &str) -> bool {
    (1..=64).contains(&team.len())
        && team
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
