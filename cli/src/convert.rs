//! `cistern convert`: rewrite a trace in cistern's own format or as an RMM log.

use std::io::Write;
use std::path::PathBuf;

use cistern_trace::load;
use cistern_trace::own;

use crate::ConvertArgs;

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// cistern's own trace format (`# cistern-trace v1`).
    Cistern,
    /// A RAPIDS RMM `logging_resource_adaptor` CSV.
    Rmm,
}

pub fn run(args: &ConvertArgs) -> Result<(), String> {
    let opts = crate::replay::load_options(args.max_input.as_deref())?;
    let traces = load::load_with(&args.input, &opts).map_err(|e| e.to_string())?;
    if traces.is_empty() {
        return Err(format!(
            "{}: no allocations to convert",
            args.input.display()
        ));
    }
    for (i, t) in traces.iter().enumerate() {
        let mut out: Box<dyn Write> = match &args.output {
            None => Box::new(std::io::stdout().lock()),
            Some(p) => {
                let path = if i == 0 {
                    p.clone()
                } else {
                    let mut s = p.clone().into_os_string();
                    s.push(format!(".dev{}", t.device));
                    PathBuf::from(s)
                };
                Box::new(
                    std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?,
                )
            }
        };
        let reserved = t.recorded_reserved.clone().unwrap_or_default();
        let r = match args.to {
            Target::Cistern => {
                own::write_with(&t.sequence, Some(&t.name), t.device, &reserved, &mut out)
            }
            Target::Rmm => own::export_rmm_csv(&t.sequence, &mut out),
        };
        r.and_then(|()| out.flush())
            .map_err(|e| format!("writing: {e}"))?;
    }
    Ok(())
}
