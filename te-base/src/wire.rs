//! The wire kit every protocol of the engine encodes and decodes with: a bounds-checked
//! [`Reader`] whose errors name the field and its offset, a [`Writer`] of little-endian fields
//! (appending to a `Vec`, or in place into a fixed buffer),
//! one [`WireError`], a versioned frame prefix ([`Preamble`]: magic bytes and a version) and
//! [`stats_table!`](crate::stats_table), which encodes a struct of counters from one list of its
//! fields.
//!
//! Pure: no I/O, so every decoder built on it is tested (and fuzzed) without sockets. Decoding
//! borrows from the frame and allocates nothing a peer merely announced: a count is checked
//! against the bytes that are really left ([`Reader::count`]) before anyone reserves room for it.
//!
//! The handshake that runs over these frames (shared key, mutual proof) is
//! [`crate::auth::initiate`] / [`crate::auth::respond`].

/// What was wrong with a frame: always the field, and where in the frame it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The frame ended inside a field.
    #[error("frame truncated: {field} needs {need} bytes at offset {at}, {left} left")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Its offset in the frame.
        at: usize,
        /// Bytes it needs.
        need: usize,
        /// Bytes that were left.
        left: usize,
    },
    /// A declared count of records that cannot fit in what is left of the frame.
    #[error("{field} at offset {at} declares {count} records of {size} bytes, only {left} bytes left")]
    CountTooLarge {
        /// The count field.
        field: &'static str,
        /// Its offset.
        at: usize,
        /// The declared count.
        count: u64,
        /// Bytes per record.
        size: usize,
        /// Bytes that were left.
        left: usize,
    },
    /// Counts that contradict each other or the frame.
    #[error("inconsistent {field} at offset {at}: {what}")]
    Inconsistent {
        /// The field.
        field: &'static str,
        /// Its offset.
        at: usize,
        /// What does not add up.
        what: &'static str,
    },
    /// Not this protocol's magic bytes: another protocol, or a stream out of sync.
    #[error("bad magic {got:02x?} (expected {expected:02x?})")]
    BadMagic {
        /// What came.
        got: Vec<u8>,
        /// This protocol's magic.
        expected: &'static [u8],
    },
    /// Another protocol version.
    #[error("protocol version {got} (this side speaks {speaks})")]
    BadVersion {
        /// What came.
        got: u8,
        /// What this build speaks.
        speaks: u8,
    },
    /// A length over what the receiver accepts.
    #[error("{field} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Announced length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// A field value out of its domain (an unknown operation or tag...).
    #[error("bad value {value} for {field} at offset {at}")]
    BadValue {
        /// The field.
        field: &'static str,
        /// Its offset.
        at: usize,
        /// The value (as u64).
        value: u64,
    },
    /// Text that is not UTF-8 (or a length that splits a character).
    #[error("{field} at offset {at} is not valid UTF-8")]
    BadUtf8 {
        /// The field.
        field: &'static str,
        /// Its offset.
        at: usize,
    },
    /// Bytes left after the last field.
    #[error("{left} trailing bytes at offset {at}")]
    Trailing {
        /// Where the last field ended.
        at: usize,
        /// Bytes after it.
        left: usize,
    },
}

/// A bounds-checked little-endian reader over one frame (or payload). Every read names its
/// field; a failed read leaves the position where it was.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// Reads `b` from its start.
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b, at: 0 }
    }

    /// Offset of the next read.
    pub fn position(&self) -> usize {
        self.at
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.b.len() - self.at
    }

    /// The next `n` bytes.
    #[inline]
    pub fn bytes(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], WireError> {
        let left = self.remaining();
        if left < n {
            return Err(WireError::Truncated {
                field,
                at: self.at,
                need: n,
                left,
            });
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    /// The next `N` bytes as an array.
    #[inline]
    pub fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(field, N)?);
        Ok(a)
    }

    /// One byte.
    #[inline]
    pub fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }

    /// u16 LE.
    #[inline]
    pub fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        self.array(field).map(u16::from_le_bytes)
    }

    /// u32 LE.
    #[inline]
    pub fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        self.array(field).map(u32::from_le_bytes)
    }

    /// u64 LE.
    #[inline]
    pub fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A byte that must be 0 or 1.
    pub fn bool(&mut self, field: &'static str) -> Result<bool, WireError> {
        let at = self.at;
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            v => {
                self.at = at;
                Err(WireError::BadValue {
                    field,
                    at,
                    value: v as u64,
                })
            }
        }
    }

    /// A string with a u32 length.
    pub fn str(&mut self, field: &'static str) -> Result<&'a str, WireError> {
        let start = self.at;
        let n = self.u32(field)? as usize;
        let at = self.at;
        let b = self.bytes(field, n).inspect_err(|_| self.at = start)?;
        std::str::from_utf8(b).map_err(|_| {
            self.at = start;
            WireError::BadUtf8 { field, at }
        })
    }

    /// A u32 count of `size`-byte records, refused unless that many records fit in what is left
    /// of the frame: a count is never trusted before the bytes behind it are there.
    #[inline]
    pub fn count(&mut self, field: &'static str, size: usize) -> Result<usize, WireError> {
        let at = self.at;
        let n = self.u32(field)? as usize;
        self.check_count(field, at, n as u64, size)
            .inspect_err(|_| self.at = at)
    }

    /// Checks a count read some other way (a u16, a header field) the same way as
    /// [`Reader::count`]: `count` records of `size` bytes must fit in what is left.
    pub fn check_count(&self, field: &'static str, at: usize, count: u64, size: usize) -> Result<usize, WireError> {
        let left = self.remaining();
        let fits = usize::try_from(count)
            .ok()
            .and_then(|n| n.checked_mul(size))
            .is_some_and(|bytes| bytes <= left);
        if fits {
            Ok(count as usize)
        } else {
            Err(WireError::CountTooLarge {
                field,
                at,
                count,
                size,
                left,
            })
        }
    }

    /// The rest of the frame.
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.b[self.at..];
        self.at = self.b.len();
        s
    }

    /// Fails unless every byte was read.
    pub fn end(&self) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            left => Err(WireError::Trailing { at: self.at, left }),
        }
    }
}

/// Little-endian field writers, implemented for `Vec<u8>` (a frame is built in a reused buffer).
pub trait Writer {
    /// One byte.
    fn u8(&mut self, v: u8);
    /// u16 LE.
    fn u16(&mut self, v: u16);
    /// u32 LE.
    fn u32(&mut self, v: u32);
    /// u64 LE.
    fn u64(&mut self, v: u64);
    /// A bool as one byte, 0 or 1.
    fn bool(&mut self, v: bool);
    /// Raw bytes.
    fn bytes(&mut self, b: &[u8]);
    /// A string with a u32 length (a string over `u32::MAX` bytes is cut there).
    fn str(&mut self, s: &str);
}

impl Writer for Vec<u8> {
    #[inline]
    fn u8(&mut self, v: u8) {
        self.push(v);
    }
    #[inline]
    fn u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    #[inline]
    fn u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    #[inline]
    fn u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    #[inline]
    fn bool(&mut self, v: bool) {
        self.push(v as u8);
    }
    #[inline]
    fn bytes(&mut self, b: &[u8]) {
        self.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        let s = &s.as_bytes()[..s.len().min(u32::MAX as usize)];
        self.u32(s.len() as u32);
        self.extend_from_slice(s);
    }
}

/// Writes in place into a buffer of fixed size (a header at the front of registered memory, an
/// array), moving past each field like `std::io::Write for &mut [u8]`. The buffer is sized by the
/// code that writes it, never by what a peer sent, so one too short for a field is a bug of that
/// code: it panics, naming the sizes.
impl Writer for &mut [u8] {
    #[inline]
    fn u8(&mut self, v: u8) {
        Writer::bytes(self, &[v]);
    }
    #[inline]
    fn u16(&mut self, v: u16) {
        Writer::bytes(self, &v.to_le_bytes());
    }
    #[inline]
    fn u32(&mut self, v: u32) {
        Writer::bytes(self, &v.to_le_bytes());
    }
    #[inline]
    fn u64(&mut self, v: u64) {
        Writer::bytes(self, &v.to_le_bytes());
    }
    #[inline]
    fn bool(&mut self, v: bool) {
        Writer::bytes(self, &[v as u8]);
    }
    #[inline]
    fn bytes(&mut self, b: &[u8]) {
        assert!(
            b.len() <= self.len(),
            "wire::Writer: {} bytes into a buffer with {} left",
            b.len(),
            self.len()
        );
        let (field, rest) = std::mem::take(self).split_at_mut(b.len());
        field.copy_from_slice(b);
        *self = rest;
    }
    fn str(&mut self, s: &str) {
        let s = &s.as_bytes()[..s.len().min(u32::MAX as usize)];
        Writer::u32(self, s.len() as u32);
        Writer::bytes(self, s);
    }
}

/// The versioned start of every frame of one protocol: its magic bytes, then a one-byte
/// version. A peer speaking another protocol or version is refused at the first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    /// The protocol's magic bytes.
    pub magic: &'static [u8],
    /// The version this build speaks.
    pub version: u8,
}

impl Preamble {
    /// Bytes of the preamble.
    pub const fn len(&self) -> usize {
        self.magic.len() + 1
    }

    /// Never empty (a version byte at least); for clippy's `len_without_is_empty`.
    pub const fn is_empty(&self) -> bool {
        false
    }

    /// Writes magic and version with any [`Writer`] (appended to a `Vec`, or in place).
    pub fn write<W: Writer + ?Sized>(&self, out: &mut W) {
        out.bytes(self.magic);
        out.u8(self.version);
    }

    /// Reads and checks magic and version.
    #[inline]
    pub fn check(&self, r: &mut Reader<'_>) -> Result<(), WireError> {
        let at = r.position();
        let got = r.bytes("magic", self.magic.len())?;
        if got != self.magic {
            r.at = at;
            return Err(WireError::BadMagic {
                got: got.to_vec(),
                expected: self.magic,
            });
        }
        let v = r.u8("version").inspect_err(|_| r.at = at)?;
        if v != self.version {
            r.at = at;
            return Err(WireError::BadVersion {
                got: v,
                speaks: self.version,
            });
        }
        Ok(())
    }
}

/// A struct of counters encoded from one list of its fields, so a field cannot be forgotten by
/// the encoder or the decoder: the list destructures the struct without `..`, so a field added to
/// the struct fails to compile until it is listed (as sent, or as `skip` for a field the
/// receiving side fills itself).
///
/// ```
/// #[derive(Debug, Default, PartialEq)]
/// pub struct Counters { pub hits: u64, pub misses: u64, pub local: u64 }
/// te_base::stats_table! {
///     /// The wire table of `Counters`.
///     pub CountersWire for Counters { send: [hits, misses], skip: [local] }
/// }
/// use te_base::wire::{Reader, StatsTable};
/// let mut out = Vec::new();
/// CountersWire::encode(&mut out, &Counters { hits: 1, misses: 2, local: 3 });
/// assert_eq!(out.len(), 8 * CountersWire::FIELDS);
/// let back = CountersWire::decode(&mut Reader::new(&out)).unwrap();
/// assert_eq!(back, Counters { hits: 1, misses: 2, local: 0 });
/// ```
#[macro_export]
macro_rules! stats_table {
    ($(#[$meta:meta])* $vis:vis $name:ident for $ty:ty { send: [$($f:ident),* $(,)?], skip: [$($s:ident),* $(,)?] $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy)]
        $vis struct $name;

        impl $crate::wire::StatsTable for $name {
            type Stats = $ty;
            const FIELDS: usize = [$(stringify!($f)),*].len();
            const NAMES: &'static [&'static str] = &[$(stringify!($f)),*];

            fn encode(out: &mut Vec<u8>, s: &$ty) {
                #[allow(unused_imports)]
                use $crate::wire::Writer as _;
                let Self::Stats { $($f,)* $($s: _,)* } = s;
                $( out.u64(*$f); )*
            }

            fn decode_into(r: &mut $crate::wire::Reader<'_>, s: &mut $ty) -> Result<(), $crate::wire::WireError> {
                let Self::Stats { $($f,)* $($s: _,)* } = s;
                $( *$f = r.u64(stringify!($f))?; )*
                Ok(())
            }
        }
    };
}

/// What [`stats_table!`](crate::stats_table) generates: the encoding of one struct of `u64`
/// counters, in the order of its list.
pub trait StatsTable {
    /// The struct.
    type Stats: Default;
    /// Counters on the wire.
    const FIELDS: usize;
    /// Their names, in wire order.
    const NAMES: &'static [&'static str];
    /// Appends the sent counters.
    fn encode(out: &mut Vec<u8>, s: &Self::Stats);
    /// Reads the sent counters into `s` (the skipped fields are left as they are).
    fn decode_into(r: &mut Reader<'_>, s: &mut Self::Stats) -> Result<(), WireError>;
    /// Reads the sent counters into a default struct.
    fn decode(r: &mut Reader<'_>) -> Result<Self::Stats, WireError> {
        let mut s = Self::Stats::default();
        Self::decode_into(r, &mut s)?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: Preamble = Preamble {
        magic: b"TW",
        version: 3,
    };

    #[derive(Debug, Default, Clone, PartialEq)]
    struct S {
        a: u64,
        b: u64,
        c: u64,
    }
    crate::stats_table! { SWire for S { send: [a, c], skip: [b] } }

    #[test]
    fn errors_name_the_field_and_its_offset() {
        let mut r = Reader::new(&[1, 0, 0, 0, 9]);
        assert_eq!(r.u32("first").unwrap(), 1);
        let e = r.u32("second").unwrap_err();
        assert_eq!(
            e,
            WireError::Truncated {
                field: "second",
                at: 4,
                need: 4,
                left: 1
            }
        );
        assert!(
            e.to_string().contains("second") && e.to_string().contains("offset 4"),
            "{e}"
        );
        assert_eq!(r.position(), 4, "a failed read does not move");
        assert_eq!(r.end(), Err(WireError::Trailing { at: 4, left: 1 }));
        assert!(matches!(
            r.bool("flag"),
            Err(WireError::BadValue {
                field: "flag",
                at: 4,
                value: 9
            })
        ));
    }

    #[test]
    fn a_count_larger_than_the_frame_is_refused_before_anything_is_allocated() {
        let mut b = Vec::new();
        b.u32(u32::MAX);
        b.u64(0);
        let e = Reader::new(&b).count("records", 24).unwrap_err();
        assert!(
            matches!(
                e,
                WireError::CountTooLarge {
                    field: "records",
                    at: 0,
                    count: 0xffff_ffff,
                    size: 24,
                    left: 8
                }
            ),
            "{e:?}"
        );
        // Exactly what is left is fine; one more is not.
        let mut b = Vec::new();
        b.u32(2);
        b.u64(0);
        assert_eq!(Reader::new(&b).count("n", 4).unwrap(), 2);
        assert!(Reader::new(&b).count("n", 5).is_err());
        // Overflowing products are refused, not wrapped.
        let r = Reader::new(&[]);
        assert!(r.check_count("n", 0, u64::MAX, 2).is_err());
        assert!(r.check_count("n", 0, 1 << 40, usize::MAX / 2).is_err());
        assert_eq!(r.check_count("n", 0, 7, 0).unwrap(), 7);
    }

    #[test]
    fn the_preamble_refuses_other_protocols_and_versions() {
        let mut f = Vec::new();
        P.write(&mut f);
        assert_eq!(f, b"TW\x03");
        assert_eq!(P.len(), 3);
        P.check(&mut Reader::new(&f)).unwrap();
        let e = P.check(&mut Reader::new(b"TW\x04")).unwrap_err();
        assert_eq!(e, WireError::BadVersion { got: 4, speaks: 3 });
        let e = P.check(&mut Reader::new(b"XW\x03")).unwrap_err();
        assert!(matches!(e, WireError::BadMagic { .. }));
        assert!(matches!(
            P.check(&mut Reader::new(b"T")),
            Err(WireError::Truncated { field: "magic", .. })
        ));
    }

    #[test]
    fn a_fixed_buffer_takes_the_same_bytes_as_a_vec_and_moves_past_them() {
        let mut v = Vec::new();
        P.write(&mut v);
        v.u16(0x0201);
        v.str("ab");
        let mut buf = [0xeeu8; 16];
        let mut w = &mut buf[..];
        P.write(&mut w);
        w.u16(0x0201);
        w.str("ab");
        assert_eq!(w.len(), 16 - v.len(), "the writer stands after what it wrote");
        assert_eq!(&buf[..v.len()], &v[..]);
        assert!(buf[v.len()..].iter().all(|&b| b == 0xee), "nothing written past it");
    }

    #[test]
    #[should_panic(expected = "4 bytes into a buffer with 3 left")]
    fn a_fixed_buffer_too_short_for_a_field_is_a_bug_that_panics() {
        let mut buf = [0u8; 3];
        (&mut buf[..]).u32(1);
    }

    #[test]
    fn a_stats_table_sends_its_list_and_leaves_the_skipped_fields() {
        assert_eq!(SWire::FIELDS, 2);
        assert_eq!(SWire::NAMES, &["a", "c"]);
        let mut out = Vec::new();
        SWire::encode(&mut out, &S { a: 1, b: 2, c: 3 });
        assert_eq!(out.len(), 16);
        assert_eq!(SWire::decode(&mut Reader::new(&out)).unwrap(), S { a: 1, b: 0, c: 3 });
        let e = SWire::decode(&mut Reader::new(&out[..12])).unwrap_err();
        assert!(matches!(e, WireError::Truncated { field: "c", at: 8, .. }), "{e:?}");
    }

    proptest! {
        #[test]
        fn fields_round_trip(a: u8, b: u16, c: u32, d: u64, e: bool, s in "\\PC{0,20}", raw in proptest::collection::vec(any::<u8>(), 0..40)) {
            let mut out = Vec::new();
            P.write(&mut out);
            out.u8(a);
            out.u16(b);
            out.u32(c);
            out.u64(d);
            out.bool(e);
            out.str(&s);
            out.u32(raw.len() as u32);
            out.bytes(&raw);
            // The same fields written in place into an exactly sized buffer are the same bytes.
            let mut fixed = vec![0u8; out.len()];
            let mut w = &mut fixed[..];
            P.write(&mut w);
            w.u8(a); w.u16(b); w.u32(c); w.u64(d); w.bool(e); w.str(&s);
            w.u32(raw.len() as u32); w.bytes(&raw);
            prop_assert!(w.is_empty());
            prop_assert_eq!(&fixed, &out);
            let mut r = Reader::new(&out);
            P.check(&mut r).unwrap();
            prop_assert_eq!(r.u8("a").unwrap(), a);
            prop_assert_eq!(r.u16("b").unwrap(), b);
            prop_assert_eq!(r.u32("c").unwrap(), c);
            prop_assert_eq!(r.u64("d").unwrap(), d);
            prop_assert_eq!(r.bool("e").unwrap(), e);
            prop_assert_eq!(r.str("s").unwrap(), s.as_str());
            let n = r.count("raw", 1).unwrap();
            prop_assert_eq!(r.bytes("raw", n).unwrap(), &raw[..]);
            r.end().unwrap();
            // Every cut is a typed error at or before the cut, never a panic.
            for cut in 0..out.len() {
                let mut r = Reader::new(&out[..cut]);
                let all = (|| -> Result<(), WireError> {
                    P.check(&mut r)?;
                    r.u8("a")?; r.u16("b")?; r.u32("c")?; r.u64("d")?; r.bool("e")?; r.str("s")?;
                    let n = r.count("raw", 1)?;
                    r.bytes("raw", n)?;
                    r.end()
                })();
                prop_assert!(all.is_err());
                prop_assert!(r.position() <= cut);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64), size in 0usize..64) {
            let mut r = Reader::new(&b);
            let _ = P.check(&mut r);
            if let Ok(n) = r.count("n", size) {
                prop_assert!(n * size <= r.remaining());
                let _ = r.bytes("records", n * size);
            }
            let _ = r.str("s");
            let _ = r.bool("b");
            let _ = SWire::decode(&mut Reader::new(&b));
            prop_assert!(r.position() <= b.len());
        }
    }
}
