//! The local-mode settings of the store (tiers, eviction, staging, debugging), each declared once
//! in the table at the end of this file: its variable, its builder setter (also the Python
//! keyword), its `umbp-server` flag if it has one, its parser, its check, its default (as the docs
//! print it and as the value it stands for) and its doc line.
//!
//! From that table come [`StoreKey`] (with `FromStr`), [`ENV_VARS`], the builder's setters and
//! their resolution (explicit setting, then the variable, then the default), the generic
//! [`StoreBuilder::set`] / [`StoreBuilder::set_text`] the Python binding and `umbp-server` loop
//! over, and [`StoreKey::doc_table`], the rows of docs/configuration.md's local-mode table (a test
//! holds the page to it).
//!
//! The table macro (`settings_table!`) takes the component: its key enum, its variables, its
//! struct of explicit settings, its error and, where it has one, its builder; it also emits the
//! unit tests every table must pass (each default's text is the value used; names, keywords and
//! flags unique), so a module holds one table. Standalone mode's settings are its second table
//! ([`crate::standalone::StandaloneKey`]), distributed mode's its third
//! (`cluster::config::ClusterKey`).
//!
//! Adding a setting: one entry in the table, the field it fills in [`crate::CoreConfig`], the line
//! in [`StoreBuilder::config`] that fills it, and its row in docs/configuration.md (the test
//! prints the row).

use std::fmt;
use std::path::PathBuf;

use super::StoreBuilder;
use crate::error::StoreError;
use crate::eviction::EvictionPolicy;
use crate::ssd::io::{DirectIo, IoBackend};
use crate::ssd::record::BLOCK;

/// The type of a setting's value as a binding passes it (a Python keyword's type).
///
/// Not `#[non_exhaustive]` on purpose: a new kind must reach every binding's match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// A byte count (`u64`; Python `int`).
    Bytes,
    /// A fraction (`f64`; Python `float`).
    Fraction,
    /// A count (`usize`; Python `int`).
    Count,
    /// On or off (`bool`; Python `bool`). As an `umbp-server` flag it takes no value.
    Switch,
    /// Directories (Python: a list of paths).
    Dirs,
    /// One of a few words, parsed as the variable is (Python `str`).
    Choice,
    /// A path (Python: `str` or `os.PathLike`).
    Path,
}

/// A setting's value as a binding passes it (see [`ValueKind`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// See [`ValueKind::Bytes`].
    Bytes(u64),
    /// See [`ValueKind::Fraction`].
    Fraction(f64),
    /// See [`ValueKind::Count`].
    Count(usize),
    /// See [`ValueKind::Switch`].
    Switch(bool),
    /// See [`ValueKind::Dirs`].
    Dirs(Vec<PathBuf>),
    /// See [`ValueKind::Choice`].
    Choice(String),
    /// See [`ValueKind::Path`].
    Path(PathBuf),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Bytes(v) => write!(f, "{v}"),
            Value::Fraction(v) => write!(f, "{v}"),
            Value::Count(v) => write!(f, "{v}"),
            Value::Switch(v) => write!(f, "{v}"),
            Value::Dirs(v) => {
                let dirs: Vec<String> = v.iter().map(|d| d.display().to_string()).collect();
                f.write_str(&dirs.join(","))
            }
            Value::Choice(v) => f.write_str(v),
            Value::Path(v) => write!(f, "{}", v.display()),
        }
    }
}

/// A type a setting can hold, with the [`ValueKind`] bindings pass it as.
pub trait SettingValue: Sized + Clone + fmt::Debug {
    /// How bindings pass it.
    const KIND: ValueKind;
    /// The typed value, or why `v` is not one.
    fn from_value(v: Value) -> std::result::Result<Self, String>;
    /// The value as an error quotes it.
    fn shown(&self) -> String;
}

macro_rules! plain_value {
    ($($ty:ty => $kind:ident),* $(,)?) => {$(
        impl SettingValue for $ty {
            const KIND: ValueKind = ValueKind::$kind;
            fn from_value(v: Value) -> std::result::Result<Self, String> {
                match v {
                    Value::$kind(v) => Ok(v),
                    other => Err(format!("expected {:?}, got {other:?}", ValueKind::$kind)),
                }
            }
            fn shown(&self) -> String {
                Value::$kind(self.clone()).to_string()
            }
        }
    )*};
}
plain_value!(
    u64 => Bytes,
    f64 => Fraction,
    usize => Count,
    bool => Switch,
    Vec<PathBuf> => Dirs,
    PathBuf => Path,
);

macro_rules! choice_value {
    ($($ty:ty),* $(,)?) => {$(
        impl $crate::config::keys::SettingValue for $ty {
            const KIND: $crate::config::keys::ValueKind = $crate::config::keys::ValueKind::Choice;
            fn from_value(v: $crate::config::keys::Value) -> std::result::Result<Self, String> {
                match v {
                    $crate::config::keys::Value::Choice(s) => $crate::config::keys::parse::text(&s),
                    other => Err(format!(
                        "expected {:?}, got {other:?}",
                        $crate::config::keys::ValueKind::Choice
                    )),
                }
            }
            fn shown(&self) -> String {
                format!("{self:?}")
            }
        }
    )*};
}
pub(crate) use choice_value;
choice_value!(EvictionPolicy, DirectIo, IoBackend, std::net::SocketAddr);

/// Text taken as given (Python `str`, passed as a [`ValueKind::Choice`]); its setting's resolution
/// judges it.
impl SettingValue for String {
    const KIND: ValueKind = ValueKind::Choice;
    fn from_value(v: Value) -> std::result::Result<Self, String> {
        match v {
            Value::Choice(s) => Ok(s),
            other => Err(format!("expected {:?}, got {other:?}", ValueKind::Choice)),
        }
    }
    fn shown(&self) -> String {
        self.clone()
    }
}

/// A signed count (Python `int`, passed as a [`ValueKind::Count`]).
impl SettingValue for i64 {
    const KIND: ValueKind = ValueKind::Count;
    fn from_value(v: Value) -> std::result::Result<Self, String> {
        match v {
            Value::Count(v) => i64::try_from(v).map_err(|e| e.to_string()),
            other => Err(format!("expected {:?}, got {other:?}", ValueKind::Count)),
        }
    }
    fn shown(&self) -> String {
        self.to_string()
    }
}

/// An unsigned 32-bit count, such as a gid (Python `int`, passed as a [`ValueKind::Count`]).
impl SettingValue for u32 {
    const KIND: ValueKind = ValueKind::Count;
    fn from_value(v: Value) -> std::result::Result<Self, String> {
        match v {
            Value::Count(v) => u32::try_from(v).map_err(|e| e.to_string()),
            other => Err(format!("expected {:?}, got {other:?}", ValueKind::Count)),
        }
    }
    fn shown(&self) -> String {
        self.to_string()
    }
}

/// Parsers of a setting's text (a variable's or a flag's value): the value, or why not.
pub(crate) mod parse {
    use std::path::PathBuf;
    use std::str::FromStr;

    /// A byte count in the one size grammar (`te_base::config::parse_byte_size`).
    pub fn bytes(raw: &str) -> Result<u64, String> {
        te_base::config::parse_byte_size(raw)
    }

    /// `FromStr`, refusing an empty value and surrounding whitespace.
    pub fn text<T: FromStr>(raw: &str) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        if raw.is_empty() {
            return Err("empty value".into());
        }
        if raw.trim() != raw {
            return Err("surrounding whitespace".into());
        }
        raw.parse::<T>().map_err(|e| e.to_string())
    }

    /// `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no`.
    pub fn switch(raw: &str) -> Result<bool, String> {
        match raw {
            "1" | "true" | "on" | "yes" => Ok(true),
            "0" | "false" | "off" | "no" => Ok(false),
            _ => Err("expected 1/0, true/false, on/off or yes/no".into()),
        }
    }

    /// Comma-separated non-empty directories.
    pub fn dirs(raw: &str) -> Result<Vec<PathBuf>, String> {
        let dirs: Vec<PathBuf> = raw.split(',').map(PathBuf::from).collect();
        if raw.is_empty() || dirs.iter().any(|d| d.as_os_str().is_empty()) {
            return Err("expected comma-separated non-empty directories".into());
        }
        Ok(dirs)
    }
}

/// Checks of one setting's value, explicit or parsed (rules between settings are in
/// [`StoreBuilder::config`]).
pub(crate) mod check {
    use super::BLOCK;

    pub(crate) type Checked = Result<(), &'static str>;

    pub fn none<T>(_: &T) -> Checked {
        Ok(())
    }

    /// `Err(reason)` where `bad`.
    pub(crate) fn unless(bad: bool, reason: &'static str) -> Checked {
        if bad {
            Err(reason)
        } else {
            Ok(())
        }
    }

    pub fn page(v: &u64) -> Checked {
        unless(
            !(*v > 0 && v.is_multiple_of(BLOCK)),
            "must be a non-zero multiple of 4096",
        )
    }

    pub fn fraction(v: &f64) -> Checked {
        unless(!(*v > 0.0 && *v <= 1.0), "must be a fraction in (0, 1]")
    }

    pub fn below_one(v: &f64) -> Checked {
        unless(!(0.0..1.0).contains(v), "must be a fraction in [0, 1)")
    }

    pub fn segment(v: &u64) -> Checked {
        unless(
            !(*v >= 16 * BLOCK && v.is_multiple_of(BLOCK)),
            "must be a multiple of 4096 of at least 64 KiB",
        )
    }

    pub fn staging(v: &u64) -> Checked {
        unless(
            !(*v >= 2 * BLOCK && v.is_multiple_of(BLOCK)),
            "must be a multiple of 4096 of at least 8 KiB",
        )
    }

    pub fn slots(v: &usize) -> Checked {
        unless(!(1..=256).contains(v), "must be 1..=256")
    }
}

/// The store's error for a malformed setting: `var`'s `value`, and why.
pub(crate) fn bad(var: &str, value: impl Into<String>, reason: impl Into<String>) -> StoreError {
    StoreError::Engine(te_base::Error::config(var, value, reason))
}

/// The resolved type of a setting: its type where it has a default, else an `Option` of it.
macro_rules! resolved_ty {
    ($ty:ty) => { Option<$ty> };
    ($ty:ty, $default:expr) => { $ty };
}
pub(crate) use resolved_ty;

/// The resolved value of a setting: with its default where it has one.
macro_rules! resolved_value {
    ($v:expr) => {
        $v
    };
    ($v:expr, $default:expr) => {
        $v.unwrap_or_else(|| $default)
    };
}
pub(crate) use resolved_value;

/// A setting's `umbp-server` flag: `(flag, value name)`, no value name for a switch.
macro_rules! flag_of {
    () => {
        None
    };
    ($flag:literal) => {
        Some(($flag, None))
    };
    ($flag:literal $value:literal) => {
        Some(($flag, Some($value)))
    };
}
pub(crate) use flag_of;

/// Whether a typed default and its text agree (`None`: no typed default).
/// Holds a table's `also:` rows to te-base's listener limits read under `prefix`: the same
/// variables, in order, with te-base's defaults.
#[cfg(test)]
pub(crate) fn assert_listener_rows(prefix: &str, rows: &[(&str, &str, &str)]) {
    use te_base::listener::*;
    let names: Vec<String> = te_base::config::LISTENER_VAR_SUFFIXES
        .iter()
        .map(|s| format!("{prefix}{s}"))
        .collect();
    let listed: Vec<&str> = rows.iter().map(|(v, ..)| *v).collect();
    assert_eq!(listed, names);
    let defaults: Vec<&str> = rows.iter().map(|(_, d, _)| *d).collect();
    let want = [
        DEFAULT_MAX_CONNECTIONS.to_string(),
        DEFAULT_MAX_PER_SOURCE.to_string(),
        DEFAULT_HANDSHAKE_TIMEOUT.as_millis().to_string(),
        DEFAULT_IDLE_TIMEOUT.as_millis().to_string(),
    ];
    assert_eq!(defaults, want);
}

#[cfg(test)]
macro_rules! default_agrees {
    ($parse:expr, $text:literal, $ty:ty) => {
        None
    };
    ($parse:expr, $text:literal, $ty:ty, $default:expr) => {{
        let parsed: std::result::Result<$ty, String> = ($parse)($text);
        let default: $ty = $default;
        Some(parsed == Ok(default))
    }};
}
#[cfg(test)]
pub(crate) use default_agrees;

/// A component's builder setters, one per setting (none where the component names no builder).
macro_rules! builder_setters {
    (; $($rest:tt)*) => {};
    ($builder:ident; $($field:ident: $ty:ty, $var:literal, $default_text:literal, $doc:literal;)*) => {
        impl $builder {
            $(
                #[doc = $doc]
                #[doc = ""]
                #[doc = concat!("Not set here: `", $var, "`; its default: ", $default_text, ".")]
                pub fn $field(mut self, v: $ty) -> Self {
                    self.settings.$field = Some(v);
                    self
                }
            )*
        }
    };
}
pub(crate) use builder_setters;

/// One component's settings table: each setting declared once (its variable, its keyword, its
/// `umbp-server` flag if any, parser, check, default as the docs print it and as the value it
/// stands for, doc line), plus the variables of the component that something else reads
/// (`also`: variable, default, doc line). From it come the key enum (with `FromStr`), the
/// component's `ENV_VARS`, a struct of explicit settings whose per-setting methods resolve
/// explicit, then variable, then default (checked; a malformed variable is an error naming it),
/// the builder's setters where a builder is named, and the docs table.
macro_rules! settings_table {
    (
        $(#[$key_meta:meta])*
        key: $key_ty:ident,
        $(#[$vars_meta:meta])*
        vars: $vars:ident,
        $(#[$settings_meta:meta])*
        settings: $settings_vis:vis $settings:ident,
        error: $bad:path => $err:ty,
        what: $what:literal,
        keyword_column: $keyword_column:literal,
        setters: $($builder:ident)?,
        entries: {$(
            #[doc = $doc:literal]
            $key:ident {
                var: $var:literal,
                set: $field:ident: $ty:ty,
                parse: $parse:expr,
                check: $check:expr,
                default: $default_text:literal $(= $default:expr)?,
                $(flag: $flag:literal $($flag_value:literal)?,)?
            }
        )*},
        also: {$(
            #[doc = $also_doc:literal]
            $also_var:literal = $also_default:literal,
        )*} $(,)?
    ) => {
        $(#[$key_meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum $key_ty {
            $(#[doc = $doc] $key,)*
        }

        $(#[$vars_meta])*
        pub const $vars: &[&str] = &[$($var,)* $($also_var,)*];

        impl $key_ty {
            /// Every setting, in the table's order.
            pub const ALL: &'static [$key_ty] = &[$($key_ty::$key),*];

            /// The component's variables that something else reads: `(variable, default as the
            /// docs print it, doc line)`. They are in the component's variables and its docs
            /// table.
            pub const READ_ELSEWHERE: &'static [(&'static str, &'static str, &'static str)] =
                &[$(($also_var, $also_default, $also_doc),)*];

            /// Its variable.
            pub fn var(self) -> &'static str {
                match self { $($key_ty::$key => $var,)* }
            }

            /// Its keyword (the builder setter where the component has a builder; the Python
            /// keyword).
            pub fn keyword(self) -> &'static str {
                match self { $($key_ty::$key => stringify!($field),)* }
            }

            /// Its `umbp-server` flag with the name of its value (none for a switch).
            pub fn flag(self) -> Option<(&'static str, Option<&'static str>)> {
                match self { $($key_ty::$key => $crate::config::keys::flag_of!($($flag $($flag_value)?)?),)* }
            }

            /// Its default as the docs print it.
            pub fn default_text(self) -> &'static str {
                match self { $($key_ty::$key => $default_text,)* }
            }

            /// Its doc line.
            pub fn doc(self) -> &'static str {
                match self { $($key_ty::$key => $doc.trim(),)* }
            }

            /// How bindings pass its value.
            pub fn kind(self) -> $crate::config::keys::ValueKind {
                match self {
                    $($key_ty::$key => <$ty as $crate::config::keys::SettingValue>::KIND,)*
                }
            }

            /// Whether the default text parses to the default the resolution uses (`None`: no
            /// default value; the text says what happens instead).
            #[cfg(test)]
            fn default_agrees(self) -> Option<bool> {
                match self {
                    $($key_ty::$key => $crate::config::keys::default_agrees!(
                        $parse, $default_text, $ty $(, $default)?
                    ),)*
                }
            }

            /// The setting whose variable or keyword is `name`.
            pub fn from_name(name: &str) -> Option<$key_ty> {
                $key_ty::ALL
                    .iter()
                    .copied()
                    .find(|k| k.var() == name || k.keyword() == name)
            }

            /// The setting whose keyword (builder setter, Python keyword) is `keyword`.
            pub fn from_keyword(keyword: &str) -> Option<$key_ty> {
                $key_ty::ALL.iter().copied().find(|k| k.keyword() == keyword)
            }

            /// The setting whose `umbp-server` flag is `flag`.
            pub fn from_flag(flag: &str) -> Option<$key_ty> {
                $key_ty::ALL
                    .iter()
                    .copied()
                    .find(|k| k.flag().is_some_and(|(f, _)| f == flag))
            }

            /// The `umbp-server` flags of the settings that have one, as a usage line shows them
            /// (`[--dram BYTES] [--write-through] ...`).
            pub fn usage_flags() -> String {
                let flags: Vec<String> = $key_ty::ALL
                    .iter()
                    .filter_map(|k| k.flag())
                    .map(|(flag, value)| match value {
                        Some(v) => format!("[{flag} {v}]"),
                        None => format!("[{flag}]"),
                    })
                    .collect();
                flags.join(" ")
            }

            /// The header and rows of the component's table in docs/configuration.md
            /// (Markdown): variable, default, keyword, `umbp-server` flag (where a setting of
            /// the component has one), meaning; then the variables read elsewhere.
            pub fn doc_table() -> String {
                let flags = $key_ty::ALL.iter().any(|k| k.flag().is_some());
                let mut head = vec!["variable", "default", $keyword_column];
                if flags {
                    head.push("`umbp-server`");
                }
                head.push("meaning");
                let mut out = format!("| {} |\n|{}\n", head.join(" | "), " --- |".repeat(head.len()));
                let mut row = |cells: Vec<String>| {
                    // A pipe inside a cell, even in code, is escaped (GitHub's tables).
                    let cells: Vec<String> = cells.into_iter().map(|c| c.replace('|', "\\|")).collect();
                    out.push_str(&format!("| {} |\n", cells.join(" | ")));
                };
                for k in $key_ty::ALL {
                    let mut cells = vec![
                        format!("`{}`", k.var()),
                        k.default_text().to_string(),
                        format!("`{}`", k.keyword()),
                    ];
                    if flags {
                        cells.push(match k.flag() {
                            Some((f, Some(v))) => format!("`{f} {v}`"),
                            Some((f, None)) => format!("`{f}`"),
                            None => String::new(),
                        });
                    }
                    cells.push(k.doc().to_string());
                    row(cells);
                }
                for (var, default, doc) in $key_ty::READ_ELSEWHERE {
                    let mut cells = vec![format!("`{var}`"), default.to_string(), String::new()];
                    if flags {
                        cells.push(String::new());
                    }
                    cells.push(doc.trim().to_string());
                    row(cells);
                }
                out
            }
        }

        impl std::str::FromStr for $key_ty {
            type Err = $err;

            /// A variable or a keyword.
            fn from_str(s: &str) -> std::result::Result<Self, $err> {
                $key_ty::from_name(s).ok_or_else(|| $bad("setting", s, concat!("not ", $what)))
            }
        }

        impl std::fmt::Display for $key_ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.var())
            }
        }

        $(#[$settings_meta])*
        #[derive(Clone, Default)]
        $settings_vis struct $settings {
            $(pub(crate) $field: Option<$ty>,)*
        }

        impl $settings {
            $(
                /// The explicit setting, else the variable, else the default; checked.
                pub(crate) fn $field(
                    &self,
                    env: &dyn te_base::config::Env,
                ) -> std::result::Result<$crate::config::keys::resolved_ty!($ty $(, $default)?), $err> {
                    let v: Option<$ty> = match &self.$field {
                        Some(v) => Some(v.clone()),
                        None => match env.get($var) {
                            None => None,
                            Some(raw) => {
                                let parsed: std::result::Result<$ty, String> = ($parse)(&raw);
                                Some(parsed.map_err(|reason| $bad($var, raw, reason))?)
                            }
                        },
                    };
                    if let Some(v) = &v {
                        ($check)(v).map_err(|reason| {
                            $bad($var, $crate::config::keys::SettingValue::shown(v), reason)
                        })?;
                    }
                    Ok($crate::config::keys::resolved_value!(v $(, $default)?))
                }
            )*

            /// Sets `key` from a binding's value (as its own setter would); `Err` says why `v`
            /// is not a value of it (a [`ValueKind::Choice`] that does not parse).
            ///
            /// [`ValueKind::Choice`]: crate::config::ValueKind::Choice
            pub fn set(
                &mut self,
                key: $key_ty,
                v: $crate::config::keys::Value,
            ) -> std::result::Result<(), String> {
                match key {
                    $($key_ty::$key => {
                        self.$field = Some(<$ty as $crate::config::keys::SettingValue>::from_value(v)?)
                    })*
                }
                Ok(())
            }

            /// Sets `key` from text parsed as its variable is; `Err` says why it does not parse.
            pub fn set_text(&mut self, key: $key_ty, raw: &str) -> std::result::Result<(), String> {
                match key {
                    $($key_ty::$key => {
                        let parsed: std::result::Result<$ty, String> = ($parse)(raw);
                        self.$field = Some(parsed?);
                    })*
                }
                Ok(())
            }
        }

        $crate::config::keys::builder_setters!(
            $($builder)?; $($field: $ty, $var, $default_text, $doc;)*
        );

        /// What every table must hold (emitted by the table macro, so one table per module).
        #[cfg(test)]
        mod settings_table_tests {
            use super::*;

            #[test]
            fn each_default_text_parses_to_the_default_used() {
                for &k in $key_ty::ALL {
                    assert_ne!(
                        k.default_agrees(),
                        Some(false),
                        "{k}: default text {:?}",
                        k.default_text()
                    );
                }
            }

            #[test]
            fn names_keywords_and_flags_are_unique_and_find_their_key() {
                // Each lookup finds the first match: finding `k` itself means no other setting
                // has its name.
                for &k in $key_ty::ALL {
                    assert_eq!($key_ty::from_name(k.var()), Some(k));
                    assert_eq!(k.var().parse::<$key_ty>().ok(), Some(k));
                    assert_eq!(k.keyword().parse::<$key_ty>().ok(), Some(k));
                    assert_eq!($key_ty::from_keyword(k.keyword()), Some(k));
                    if let Some((flag, value)) = k.flag() {
                        assert_eq!($key_ty::from_flag(flag), Some(k));
                        // Only a switch's flag goes without a value.
                        assert_eq!(
                            value.is_none(),
                            k.kind() == $crate::config::keys::ValueKind::Switch,
                            "{k}"
                        );
                    }
                }
                let vars: std::collections::HashSet<&str> = $vars.iter().copied().collect();
                assert_eq!(vars.len(), $vars.len(), "a variable listed twice");
                assert_eq!($vars.len(), $key_ty::ALL.len() + $key_ty::READ_ELSEWHERE.len());
                let typo = format!("{}_TYPO", $key_ty::ALL[0].var());
                let e = typo.parse::<$key_ty>().err().map(|e| e.to_string());
                assert!(
                    e.as_deref().is_some_and(|e| e.contains(concat!("not ", $what))),
                    "{typo}: {e:?}"
                );
            }
        }
    };
}
pub(crate) use settings_table;

impl StoreBuilder {
    /// Sets `key` from a binding's value (as its own setter would); `Err` says why `v` is not a
    /// value of it (a [`ValueKind::Choice`] that does not parse).
    pub fn set(mut self, key: StoreKey, v: Value) -> std::result::Result<Self, String> {
        self.settings.set(key, v)?;
        Ok(self)
    }

    /// Sets `key` from text parsed as its variable is (an `umbp-server` flag's value); `Err`
    /// says why it does not parse.
    pub fn set_text(mut self, key: StoreKey, raw: &str) -> std::result::Result<Self, String> {
        self.settings.set_text(key, raw)?;
        Ok(self)
    }
}

settings_table! {
    /// A local-mode setting of the store (see the module docs: each is declared once).
    key: StoreKey,
    /// The local-mode variables (tiers, eviction, staging, debugging).
    vars: ENV_VARS,
    /// What the builder was told explicitly, by setting.
    settings: pub(crate) Settings,
    error: bad => StoreError,
    what: "a local-mode UMBP setting",
    keyword_column: "builder / Python",
    setters: StoreBuilder,
    entries: {
        /// DRAM arena bytes (0: no DRAM tier).
        DramCapacity {
            var: "UMBP_DRAM_CAPACITY",
            set: dram_capacity: u64,
            parse: parse::bytes,
            check: check::none,
            default: "1G" = 1 << 30,
            flag: "--dram" "BYTES",
        }
        /// Allocation unit of the arena (a multiple of 4 KiB).
        DramPageBytes {
            var: "UMBP_DRAM_PAGE_BYTES",
            set: dram_page_bytes: u64,
            parse: parse::bytes,
            check: check::page,
            default: "4K" = 4096,
        }
        /// Fraction of the arena at which eviction starts.
        DramHighWatermark {
            var: "UMBP_DRAM_HIGH_WATERMARK",
            set: high_watermark: f64,
            parse: parse::text,
            check: check::fraction,
            default: "0.95" = 0.95,
        }
        /// Fraction eviction brings the arena down to (at most the high watermark).
        DramLowWatermark {
            var: "UMBP_DRAM_LOW_WATERMARK",
            set: low_watermark: f64,
            parse: parse::text,
            check: check::fraction,
            default: "0.85" = 0.85,
        }
        /// Eviction policy: `lru`, `prefix` or `prefix:N` (window of N candidates).
        Eviction {
            var: "UMBP_EVICTION",
            set: eviction: EvictionPolicy,
            parse: parse::text,
            check: check::none,
            default: "prefix" = EvictionPolicy::default(),
            flag: "--eviction" "lru|prefix|prefix:N",
        }
        /// SSD directories, comma-separated, one per drive (unset or empty: no SSD tier).
        SsdDirs {
            var: "UMBP_SSD_DIRS",
            set: ssd_dirs: Vec<PathBuf>,
            parse: parse::dirs,
            check: check::none,
            default: "unset",
            flag: "--ssd-dirs" "DIR,...",
        }
        /// SSD bytes over all directories (default: 90% of each directory's filesystem free space at open, plus the log there).
        SsdCapacity {
            var: "UMBP_SSD_CAPACITY",
            set: ssd_capacity: u64,
            parse: parse::bytes,
            check: check::none,
            default: "90% of free",
            flag: "--ssd-capacity" "BYTES",
        }
        /// Sealed segments whose live fraction is below this are compacted.
        SsdCompactBelow {
            var: "UMBP_SSD_COMPACT_BELOW",
            set: compact_below: f64,
            parse: parse::text,
            check: check::below_one,
            default: "0.5" = 0.5,
        }
        /// Size of one log segment file.
        SsdSegmentBytes {
            var: "UMBP_SSD_SEGMENT_BYTES",
            set: ssd_segment_bytes: u64,
            parse: parse::bytes,
            check: check::segment,
            default: "256M" = 256 << 20,
        }
        /// O_DIRECT: `auto`, `on`, `off`.
        SsdDirect {
            var: "UMBP_SSD_DIRECT",
            set: ssd_direct: DirectIo,
            parse: parse::text,
            check: check::none,
            default: "auto" = DirectIo::default(),
        }
        /// I/O engine of the SSD tier: `auto`, `uring`, `psync`.
        SsdIo {
            var: "UMBP_SSD_IO",
            set: ssd_io: IoBackend,
            parse: parse::text,
            check: check::none,
            default: "auto" = IoBackend::default(),
        }
        /// Bytes of one registered staging slot for SSD reads and writes.
        SsdStagingBytes {
            var: "UMBP_SSD_STAGING_BYTES",
            set: staging_bytes: u64,
            parse: parse::bytes,
            check: check::staging,
            default: "32M" = 32 << 20,
        }
        /// Staging slots (concurrent SSD calls), 1 to 256.
        SsdStagingSlots {
            var: "UMBP_SSD_STAGING_SLOTS",
            set: staging_slots: usize,
            parse: parse::text,
            check: check::slots,
            default: "4" = 4,
        }
        /// Every put also goes to the SSD log before it returns.
        SsdWriteThrough {
            var: "UMBP_SSD_WRITE_THROUGH",
            set: write_through: bool,
            parse: parse::switch,
            check: check::none,
            default: "0" = false,
            flag: "--write-through",
        }
        /// Whole-object SSD reads are copied into DRAM.
        PromoteOnRead {
            var: "UMBP_PROMOTE_ON_READ",
            set: promote_on_read: bool,
            parse: parse::switch,
            check: check::none,
            default: "1" = true,
        }
        /// Per-phase timings of ranged calls.
        RangedCallDebug {
            var: "UMBP_RANGED_CALL_DEBUG",
            set: ranged_call_debug: bool,
            parse: parse::switch,
            check: check::none,
            default: "0" = false,
        }
    },
    also: {},
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_its_check_refuses_is_quoted_as_written() {
        let env = |pairs: &[(&str, &str)]| {
            let map = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            std::sync::Arc::new(te_base::config::MapEnv(map))
        };
        let err = StoreBuilder::new()
            .env(env(&[("UMBP_SSD_DIRS", "/tmp/x"), ("UMBP_SSD_COMPACT_BELOW", "1")]))
            .config()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            StoreError::Engine(te_base::Error::config(
                "UMBP_SSD_COMPACT_BELOW",
                "1",
                "must be a fraction in [0, 1)"
            ))
            .to_string()
        );
        let err = StoreBuilder::new().dram_page_bytes(1000).config().unwrap_err();
        assert!(err.to_string().contains("UMBP_DRAM_PAGE_BYTES=\"1000\""), "{err}");
    }

    #[test]
    fn values_of_the_wrong_kind_or_a_bad_choice_are_refused() {
        let b = StoreBuilder::new();
        assert!(b.clone().set(StoreKey::DramCapacity, Value::Switch(true)).is_err());
        let err = b
            .clone()
            .set(StoreKey::Eviction, Value::Choice("random".into()))
            .err()
            .unwrap();
        assert!(err.contains("unknown eviction policy"), "{err}");
        assert!(b.clone().set_text(StoreKey::DramCapacity, "lots").is_err());
        assert!(b.clone().set_text(StoreKey::SsdDirs, "/a,,/b").is_err());
        let c = b
            .set(StoreKey::Eviction, Value::Choice("lru".into()))
            .unwrap()
            .set_text(StoreKey::DramCapacity, "8M")
            .unwrap()
            .config()
            .unwrap();
        assert_eq!(c.core.eviction, EvictionPolicy::Lru);
        assert_eq!(c.core.dram_capacity, 8 << 20);
    }
}
