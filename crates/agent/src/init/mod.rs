//! PID 1 duties inside the VM: filled in by the Foundation work.

pub fn boot() -> anyhow::Result<()> {
    Ok(())
}

pub fn power_off() -> ! {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
