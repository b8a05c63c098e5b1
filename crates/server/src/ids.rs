//! Random identifiers and secrets from the operating system's CSPRNG.

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
