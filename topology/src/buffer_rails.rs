//! The rails one buffer is registered on, as a segment descriptor carries them to peers, so a
//! transfer can be served (and striped) by the rails both sides hold.

use serde::{Deserialize, Serialize};

use super::striping::RailRate;
use te_base::error::{Error, Result};

/// Most rails one buffer may list; a descriptor from a peer listing more is rejected.
pub const MAX_RAILS_PER_BUFFER: usize = 256;

/// A validated rail list: ascending by rail index, no duplicates, at most
/// [`MAX_RAILS_PER_BUFFER`] entries. Transports embed it in their entry of
/// [`ExportedBuffer::keys`](te_base::ExportedBuffer::keys) next to their per-rail keys.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct BufferRails {
    rails: Vec<RailRate>,
}

impl BufferRails {
    /// Sorts `rails` by index and checks them.
    pub fn new(mut rails: Vec<RailRate>) -> Result<BufferRails> {
        rails.sort_by_key(|r| r.rail);
        check(&rails).map_err(Error::InvalidDescriptor)?;
        Ok(BufferRails { rails })
    }

    /// Reads a list written by [`to_value`](Self::to_value), typically received from a peer.
    /// Anything else is [`Error::InvalidDescriptor`] saying what is wrong.
    pub fn from_value(value: &serde_json::Value) -> Result<BufferRails> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Wire {
            rails: Vec<RailRate>,
        }
        let wire: Wire = serde_json::from_value(value.clone())
            .map_err(|e| Error::InvalidDescriptor(format!("buffer rails: {e}")))?;
        if wire.rails.windows(2).any(|w| w[0].rail >= w[1].rail) {
            return Err(Error::InvalidDescriptor(
                "buffer rails: not strictly ascending by rail index".into(),
            ));
        }
        check(&wire.rails).map_err(Error::InvalidDescriptor)?;
        Ok(BufferRails { rails: wire.rails })
    }

    /// The JSON form: `{"rails": [{"rail": 0, "rate_mbps": 100000}, ...]}`.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::json!({ "rails": self.rails })
    }

    /// The rails with their rates, ascending by index.
    pub fn rates(&self) -> &[RailRate] {
        &self.rails
    }

    /// True if the buffer is registered on `rail`.
    pub fn contains(&self, rail: usize) -> bool {
        self.rails.binary_search_by_key(&rail, |r| r.rail).is_ok()
    }
}

fn check(rails: &[RailRate]) -> std::result::Result<(), String> {
    if rails.len() > MAX_RAILS_PER_BUFFER {
        return Err(format!(
            "buffer rails: {} rails (at most {MAX_RAILS_PER_BUFFER})",
            rails.len()
        ));
    }
    if let Some(w) = rails.windows(2).find(|w| w[0].rail == w[1].rail) {
        return Err(format!("buffer rails: rail {} listed twice", w[0].rail));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_bad_lists() {
        let r = |rail, rate_mbps| RailRate { rail, rate_mbps };
        let rails = BufferRails::new(vec![r(3, 100), r(1, 200)]).unwrap();
        assert_eq!(rails.rates(), [r(1, 200), r(3, 100)]);
        assert!(rails.contains(3) && !rails.contains(2));
        assert_eq!(BufferRails::from_value(&rails.to_value()).unwrap(), rails);
        assert!(BufferRails::new(vec![r(1, 1), r(1, 2)]).is_err());
        for bad in [
            serde_json::json!({"rails": [{"rail": 2, "rate_mbps": 1}, {"rail": 1, "rate_mbps": 1}]}),
            serde_json::json!({"rails": [{"rail": -1, "rate_mbps": 1}]}),
            serde_json::json!({"rails": "all"}),
            serde_json::json!({"rails": [], "extra": 1}),
            serde_json::json!({"rails": (0..300).map(|i| serde_json::json!({"rail": i, "rate_mbps": 1})).collect::<Vec<_>>()}),
        ] {
            let err = BufferRails::from_value(&bad).unwrap_err();
            assert!(matches!(err, Error::InvalidDescriptor(_)), "{err}");
        }
    }
}
