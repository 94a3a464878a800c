"""What an attacker reports: how much it did and what went wrong (all zero to pass)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    name: str
    #: units of attack done (transactions, packets, modules, kills), by kind
    done: dict[str, int] = field(default_factory=dict)
    daemon_crashes: int = 0
    firmware_crashes: int = 0
    hangs: int = 0
    escapes: int = 0  # a bystander's data changed, or an attacker reached what is not its own
    leaks: int = 0  # books, descriptors or /dev/shm not back to where they were
    #: answers outside what the attack expects (a refusal that should have been another)
    unexpected: int = 0
    #: errno name -> count of the answers the attacker got (EIO must stay 0)
    errnos: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.daemon_crashes or self.firmware_crashes or self.hangs or self.escapes
                    or self.leaks or self.unexpected or self.errnos.get("EIO"))

    def line(self) -> str:
        done = ", ".join(f"{v:,} {k}" for k, v in self.done.items())
        return (f"{self.name}: {done} in {self.seconds:.0f} s; daemon crashes "
                f"{self.daemon_crashes}, firmware crashes {self.firmware_crashes}, hangs "
                f"{self.hangs}, escapes {self.escapes}, leaks {self.leaks}, unexpected "
                f"{self.unexpected}, EIO {self.errnos.get('EIO', 0)}")
